"""Tests of gpuscaler/signals."""
