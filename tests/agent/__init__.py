"""Tests of gpuscaler/agent."""
