"""The worker host: ``poolctl worker`` (``worker``), what it keeps on disk (``state``), its client."""
