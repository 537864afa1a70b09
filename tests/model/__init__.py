"""Tests of gpuscaler/model."""
