"""dcmha's tests, one folder per part of the package (tools/test_all.py runs them)."""
