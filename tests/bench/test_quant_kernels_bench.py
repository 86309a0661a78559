"""`python -m tokenmill.bench.quant_kernels`: its variants run and its markdown marks the
fastest int-weight path (tiny rows and budget: no timing is asserted)."""

from __future__ import annotations

from tokenmill.bench import quant_kernels


def test_every_variant_runs_and_the_table_marks_the_fastest(monkeypatch) -> None:
    monkeypatch.setattr(quant_kernels, "SHAPES", [("tiny", 64, 64)])
    records = quant_kernels.run([1, 3], budget_s=0.0)
    assert [r["rows"] for r in records] == [1, 3]
    names = set(records[0]["us"])
    assert {"int4 g32 kernel", "int4 g32 PyTorch kernel", "int8 PyTorch kernel"} <= names
    table = quant_kernels.markdown(records).splitlines()
    assert len(table) == 4 and table[2].startswith("| tiny (64x64) | 1 |")
    assert all(row.count("**") == 2 for row in table[2:])
