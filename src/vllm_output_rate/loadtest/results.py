"""A run's result: the spec, every request record and the per-user summaries.

``LoadResult`` is what ``run_load`` returns and what the report draws.  It is
also the JSON result file (``write_json`` / ``read_json``, format
``JSON_FORMAT``): the spec, the summaries and, by default, every chunk's
arrival time, so that a saved run can be summarized again or plotted later.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_output_rate.loadtest.spec import LoadSpec, UserLoad
from vllm_output_rate.loadtest.summary import (
    CAVEAT,
    RequestRecord,
    UserSummary,
    summarize,
)

JSON_FORMAT = "vllm-output-rate-load/1"


@dataclass
class LoadResult:
    """Everything a run produced.  ``elapsed_s`` runs from the start to the
    end of the last request; ``users`` is in the order of ``spec.users``.
    ``window_opened_s``: ``time.monotonic()`` when the run's window opened,
    the zero of its records' times, so that runs taken side by side on one
    machine can be lined up (None in a file written before it was kept)."""

    spec: LoadSpec
    started_at: str
    elapsed_s: float
    records: list[RequestRecord]
    users: list[UserSummary]
    bin_s: float = 1.0
    window_opened_s: float | None = None

    @classmethod
    def build(
        cls,
        spec: LoadSpec,
        records: list[RequestRecord],
        elapsed_s: float,
        started_at: str = "",
        bin_s: float = 1.0,
        window_opened_s: float | None = None,
    ) -> LoadResult:
        return cls(
            spec=spec,
            started_at=started_at,
            elapsed_s=elapsed_s,
            records=records,
            users=summarize(spec.users, records, elapsed_s, bin_s),
            bin_s=bin_s,
            window_opened_s=window_opened_s,
        )

    @property
    def failed_requests(self) -> list[RequestRecord]:
        """Requests that did not complete, 429s apart (``rejected_requests``)."""
        return [r for r in self.records if not r.ok and not r.rejected]

    @property
    def rejected_requests(self) -> list[RequestRecord]:
        """Requests refused with HTTP 429 (the user's own excess)."""
        return [r for r in self.records if r.rejected]

    @property
    def ok(self) -> bool:
        """True when no request failed."""
        return not self.failed_requests

    @property
    def total_tokens(self) -> int:
        return sum(u.tokens_client for u in self.users)

    def user(self, name: str | None) -> UserSummary:
        for u in self.users:
            if u.name == name:
                return u
        raise KeyError(name)

    def error_summary(
        self, limit: int = 5, failed: Iterable[RequestRecord] | None = None
    ) -> list[str]:
        """The most common error texts of failed requests, with counts
        (of ``failed`` where given: a caller that expects some failures)."""
        counts: dict[str, int] = {}
        for r in self.failed_requests if failed is None else failed:
            text = r.error or f"HTTP {r.status}"
            counts[text] = counts.get(text, 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        return [f"{n} x {text}" for text, n in ranked[:limit]]

    def to_dict(self, include_chunks: bool = True) -> dict[str, Any]:
        spec = asdict(self.spec)
        spec.pop("api_keys", None)  # secrets stay out of result files
        records = []
        for r in self.records:
            d = r.to_dict()
            if not include_chunks:
                d["chunks"] = []
                d["tokens"] = r.tokens
            records.append(d)
        users = []
        for u in self.users:
            d = asdict(u)
            d["label"] = u.label
            d["tokens_agree"] = u.tokens_agree
            users.append(d)
        return {
            "format": JSON_FORMAT,
            "started_at": self.started_at,
            "elapsed_s": self.elapsed_s,
            "bin_s": self.bin_s,
            "window_opened_monotonic_s": self.window_opened_s,
            "caveat": CAVEAT,
            "spec": spec,
            "users": users,
            "records": records,
        }

    def to_json(self, indent: int | None = 2, include_chunks: bool = True) -> str:
        return json.dumps(self.to_dict(include_chunks=include_chunks), indent=indent)

    def write_json(self, path: str | Path, include_chunks: bool = True) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json(include_chunks=include_chunks) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoadResult:
        """Rebuild a result from ``to_dict()`` output (summaries recomputed;
        with ``include_chunks=False`` the per-chunk data, and so the rates,
        cannot be recomputed: use the stored ``users`` instead)."""
        spec_d = dict(d["spec"])
        spec_d["users"] = [UserLoad(**u) for u in spec_d["users"]]
        spec = LoadSpec(**spec_d)
        records = []
        for r in d["records"]:
            r = {k: v for k, v in r.items() if k != "tokens"}
            records.append(RequestRecord.from_dict(r))
        return cls.build(
            spec,
            records,
            float(d["elapsed_s"]),
            started_at=d.get("started_at", ""),
            bin_s=float(d.get("bin_s", 1.0)),
            window_opened_s=d.get("window_opened_monotonic_s"),
        )

    @classmethod
    def read_json(cls, path: str | Path) -> LoadResult:
        return cls.from_dict(json.loads(Path(path).read_text()))
