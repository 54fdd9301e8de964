"""What a policy is to the product, declared beside it and required at registration:

default       what a request that names no policy gets, in one temperature regime
              (serving/speculation.py, ``default_spec``);
peer          a published method or baseline, with the work it follows (a short citation);
experimental  ours, not the default anywhere.

A default may follow a paper too (`specdec`); every temperature regime has exactly one default
(tests/test_policy_registry.py)."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("default", "peer", "experimental")
# The regimes the default is chosen per (a request's default temperature is 1.0: T > 0).
TEMPERATURES = ("T = 0", "T > 0")


@dataclass(frozen=True)
class PolicyLabel:
    kind: str
    temperature: str | None = None  # default: the regime it is the default for
    follows: str | None = None  # peer (a default may have one): the published work

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"label kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == "default") != (self.temperature is not None):
            raise ValueError("a default names its temperature regime, and only a default does")
        if self.temperature is not None and self.temperature not in TEMPERATURES:
            raise ValueError(
                f"temperature must be one of {', '.join(TEMPERATURES)}, got {self.temperature!r}"
            )
        if self.kind == "peer" and not self.follows:
            raise ValueError("a peer names the paper or method it follows")
        if self.kind == "experimental" and self.follows:
            raise ValueError("an experimental policy follows no paper (label it peer)")

    def __str__(self) -> str:
        text = f"default at {self.temperature}" if self.kind == "default" else self.kind
        return f"{text}: {self.follows}" if self.follows else text

    def as_dict(self) -> dict[str, str]:
        out = {"kind": self.kind}
        if self.temperature is not None:
            out["temperature"] = self.temperature
        if self.follows is not None:
            out["follows"] = self.follows
        return out


def default(temperature: str, follows: str | None = None) -> PolicyLabel:
    return PolicyLabel("default", temperature, follows)


def peer(follows: str) -> PolicyLabel:
    return PolicyLabel("peer", follows=follows)


EXPERIMENTAL = PolicyLabel("experimental")
