"""Benchmarks: python -m minagi.bench dispatch [...]. A bench measures and reports ratios beside the
figures the design asks for; it judges none of them (docs/benchmarks.md says which are met, and
where one is out of any backend's reach)."""


def print_ratios(rows, title: str, width: int = 28) -> None:
    """A bench's ratios, one line each, with the design's figure beside: [(what, value, asked)]."""
    if not rows:
        return
    print(f"\n{title}")
    for what, value, asked in rows:
        print(f"  {what:<{width}}{value:>8.2f}  (design: {asked})")


def as_json(rows) -> list[dict]:
    return [dict(zip(("what", "value", "design"), r)) for r in rows]
