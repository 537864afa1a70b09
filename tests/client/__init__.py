"""Tests of the clients: what `gpuscaler query` shows of an answer."""
