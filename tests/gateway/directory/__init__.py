"""Tests of gpuscaler/gateway/directory."""
