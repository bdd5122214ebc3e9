"""The ground floor: errors, settings, validation, database helpers and the retry policy.

Everything else (store, board, tasks, the applications) stands on it; it
imports nothing of the project above it. See ``docs/design.md``.
"""
