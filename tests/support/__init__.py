"""Test-only harnesses: helpers the tests share that the shipped packages do not need."""
