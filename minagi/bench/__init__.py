"""Benchmarks: python -m minagi.bench dispatch [...]."""


def print_targets(targets, title: str, width: int = 28) -> None:
    """A bench's targets, one line each: [(what, value, target, met)]."""
    if not targets:
        return
    print(f"\n{title}")
    for what, value, target, met in targets:
        print(f"  {what:<{width}}{value:>8.2f}  target {target:<8} {'met' if met else 'NOT MET'}")
