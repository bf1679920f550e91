"""The data layer: the pool's endpoints, what each last reported, and what this picker has sent there.

The datastore, in-flight accounting, the static pool, the scrape loops and their worker process, the
metrics-page reader and the engines' metric tables, and the small HTTP client the scrapes use.
"""
