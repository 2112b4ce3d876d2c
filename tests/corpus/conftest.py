# The corpus modules are imported by tests/test_corpus.py (as `corpus.<name>`); pytest does not
# collect them itself (no doctests in them, and no second import under another name).
collect_ignore_glob = ["*.py"]
