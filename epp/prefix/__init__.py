"""The prefix-cache index: prompt hashing and a per-pod index of the prompt blocks each pod holds.

A leaf library (it imports nothing else of epp): the prefix-cache producer plugins build on it.
"""
