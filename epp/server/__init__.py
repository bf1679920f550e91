"""The process: the command line and its flags, the frozen settings, the servers and their lifecycle."""
