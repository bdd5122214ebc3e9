"""``poolctl serve``: the worker protocol over HTTP (``app.create_app``), run by uvicorn (``serve.run``)."""
