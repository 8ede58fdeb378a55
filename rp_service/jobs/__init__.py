"""The daemon's side of a job: the SQLite store, the orchestrator that queues and runs
workers, the event fan-out, uploads, and what is checked before a job is accepted.
"""
