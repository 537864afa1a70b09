"""Unit and in-process tests (``make unit``), and the fakes and builders they share with the e2e suite."""
