"""moechat: a terminal chat that runs Mixture-of-Experts models larger than the GPU, fast."""

__version__ = "0.1.0"


def commit(root=None) -> str:
    """The checkout's commit, short (moechat runs from its checkout, so the version alone does not say which code
    runs: bug reports need this); "" outside a git checkout."""
    from pathlib import Path

    git = Path(root or Path(__file__).parent) / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            loose = git / ref
            if loose.is_file():
                head = loose.read_text().strip()
            else:  # packed by `git gc`: "SHA ref" lines
                lines = (git / "packed-refs").read_text().splitlines()
                head = next(line.split()[0] for line in lines if line.endswith(" " + ref))
        return head[:9] if len(head) == 40 and all(c in "0123456789abcdef" for c in head) else ""
    except (OSError, StopIteration, UnicodeDecodeError):
        return ""


def version_text() -> str:
    """`moechat 0.1.0 (commit 4782904ab)`, or without the commit outside a checkout."""
    sha = commit()
    return f"moechat {__version__}" + (f" (commit {sha})" if sha else "")
