"""``poolctl board serve``: the built-in Kanban over the board API (docs/board-api.md)."""
