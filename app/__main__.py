"""``python -m app [overrides]``: the command-line front (``app/cli/``) takes it from here."""

from app.cli import main

if __name__ == "__main__":
    main()
