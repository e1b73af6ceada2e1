"""Stores: the SQLite stores and snapshot model, PostgreSQL stores."""
