"""Example sagas to copy: order fulfilment and a money transfer between two banks.

Each service lives in ``sagas.services`` with its own tables (a ``MetaData`` per service), its
commands and replies, and its handlers. The saga modules only compose them; ``sagas.app`` puts
everything in one :class:`saga_engine.app.App`.
"""
