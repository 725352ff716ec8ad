"""``quickdraft bench --batch-size``: batched plain decoding against batched speculation, per
category and batch size, every greedy row token for token plain decoding's; a head method,
which has no batch policy, drafts the k a generator settles for it (what the server runs)."""

from __future__ import annotations

import json

from quickdraft.cli import main
from quickdraft.generator import SpeculativeGenerator


def test_batch_bench_rows_are_lossless_and_head_methods_draft_the_settled_k(tmp_path, monkeypatch, capsys):
    settled = []

    def settled_k(self):  # as if the cost model had settled 3 (eagle) or the method's own k
        settled.append(self.plan.method)
        return 3

    monkeypatch.setattr(SpeculativeGenerator, "settled_k", settled_k)
    out = tmp_path / "batch.json"
    assert main(["bench", "--batch-size", "1,2", "--methods", "ar,eagle,hybrid-eagle", "--categories", "short",
                 "--max-new-tokens", "24", "--repeats", "1", "--json", str(out), "--quiet"]) == 0
    assert sorted(settled) == ["eagle", "hybrid-eagle"]
    result = json.loads(out.read_text())
    assert result["batch_sizes"] == [1, 2] and result["methods"] == ["eagle", "hybrid-eagle"]
    (group,) = result["results"]
    by_size = {row["batch_size"]: row["methods"] for row in group["rows"]}
    for methods in by_size.values():
        assert all(m["lossless"] for m in methods.values()), methods
    # Drafted tokens a pass: eagle's chains of 3 (not HEAD_BATCH_K's 6), at 2 rows only in
    # the steps where they measure faster than plain ones (PlainWhenFaster, as the server);
    # hybrid-eagle's lookups up to 3 alone, up to its chain's 2 beside another row.
    assert 2 < by_size[1]["eagle"]["k"] <= 3 and 0 < by_size[2]["eagle"]["k"] < 3, by_size
    assert by_size[2]["hybrid-eagle"]["k"] <= 2 < by_size[1]["hybrid-eagle"]["k"] <= 3, by_size
    assert "| short | 2 |" in capsys.readouterr().out
