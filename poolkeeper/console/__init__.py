"""The operator console at ``/ui``: server-rendered pages over the store and the board (``mount.install``)."""
