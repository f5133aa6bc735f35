"""Postmortems: the replay engine, the ``deo replay`` command and the SQLite export."""
