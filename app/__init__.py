"""DeltaDesk's desktop program (PySide6): windows, widgets, the engine worker thread, history.

It reaches the engine only through its public modules (``engine.api``, ``engine.events``,
``engine.sampling``, ``engine.errors``); ``python -m app`` starts it.
"""
