"""Tests of gpuscaler/query."""
