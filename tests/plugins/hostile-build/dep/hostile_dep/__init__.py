"""An sdist dependency of the hostile package (test fixture)."""
