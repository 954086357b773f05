"""Tiny model zoo: synthetic knowledge-QA data (``data``) and its tokenizer (``tokenizer``)."""
