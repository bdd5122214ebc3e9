"""Public test kits for code that plugs into poolkeeper; they import pytest, which must be installed.

``board_contract.BoardContract``: the ``Board`` protocol's contract, for any board backend
(docs/board-backends.md).
"""
