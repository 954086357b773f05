"""Mutation testing of the suite (see __main__.py); not collected by pytest."""
