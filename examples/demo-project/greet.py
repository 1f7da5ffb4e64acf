"""The demo project's code: one small function for the agent to work on."""


def greet(name: str) -> str:
    """Return a friendly greeting for ``name`` ("world" when it is empty)."""
    return f"Hello, {name.strip() or 'world'}!"


if __name__ == "__main__":
    import sys

    print(greet(" ".join(sys.argv[1:])))
