"""User-facing extras around the worker: the embedded ``broker``, ``demo``,
``verify``, ``build_engine``, and the client-side helpers they share
(``topics``, ``processes``)."""
