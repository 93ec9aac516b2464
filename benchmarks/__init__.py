import evalrun  # noqa: F401  (first: its process settings must precede torch; evalrun/process.py)
