"""Result records (one JSONL line per input line, docs/design.md §4.2) and the output manifest (§4.3).

Both are frozen pydantic models so that whatever reads an output object or a manifest checks
it against the contract; the hot paths (one result line per record) serialise with orjson.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, Literal, get_args

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.ids import VALIDATION_SHARD_ID
from airflow_deadline_batch.core.records import LineError

__all__ = [
    "FINALIZE_ATTEMPT_ID",
    "MANIFEST_VERSION",
    "RESULT_STATUSES",
    "VALIDATION_ATTEMPT_ID",
    "VALIDATION_SHARD_ID",
    "Choice",
    "FinishReason",
    "InputInfo",
    "ManifestShard",
    "ModelInfo",
    "OutcomeCounts",
    "OutputManifest",
    "ResultError",
    "ResultRecord",
    "ResultStatus",
    "SettledUsage",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "encode_line_error",
    "encode_results",
]

MANIFEST_VERSION: Literal[1] = 1
#: ``attempt_id`` of the outcomes of invalid lines, written by the planner (their ``shard_id`` is
#: ``core.ids.VALIDATION_SHARD_ID``)
VALIDATION_ATTEMPT_ID = "plan"
#: ``attempt_id`` of the outcomes the finalizer writes for records that never committed
#: (``expired``, ``cancelled``, or ``errored`` with code ``shard_failed``)
FINALIZE_ATTEMPT_ID = "finalize"

ResultStatus = Literal["succeeded", "errored", "cancelled", "expired"]
#: why generation stopped: a stop condition (end of sequence, a stop string) or ``max_tokens``
FinishReason = Literal["stop", "length"]
#: every terminal status, in the order reports and manifests list them
RESULT_STATUSES: tuple[ResultStatus, ...] = get_args(ResultStatus)
_SHA256 = r"^[0-9a-f]{64}$"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Usage(_Frozen):
    """Tokens consumed by one record."""

    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)


class ResultError(_Frozen):
    """Why a record has no output: an input error code (``invalid_json``, ...) or a run-time one."""

    code: str = Field(min_length=1)
    message: str


class TopLogprob(_Frozen):
    """One of the most likely tokens at a position, with its log probability."""

    token: str
    logprob: float


class TokenLogprob(_Frozen):
    """A generated token, its log probability and (when asked) the most likely alternatives."""

    token: str
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()


class Choice(_Frozen):
    """One generated output of a record: ``n > 1`` gives several, ``logprobs`` adds per-token data."""

    index: int = Field(ge=0)
    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


class ResultRecord(_Frozen):
    """The terminal outcome of one input line.

    ``finish_reason`` and ``choices`` are optional and written only when set, so records without
    them keep their exact bytes: ``output`` is always the first (or only) output, ``choices``
    appears when a request asked for ``n > 1`` or log probabilities and then lists every output,
    ``choices[0].text == output``.
    """

    line: int = Field(ge=1)
    id: str | None
    status: ResultStatus
    output: str | None = None
    error: ResultError | None = None
    usage: Usage = Usage()
    shard_id: str
    attempt_id: str
    finish_reason: FinishReason | None = None
    choices: tuple[Choice, ...] | None = None

    @model_validator(mode="after")
    def _output_xor_error(self) -> ResultRecord:
        if self.status == "succeeded":
            if self.output is None or self.error is not None:
                raise ValueError(f"line {self.line}: a succeeded result needs an output and no error")
        elif self.error is None or self.output is not None:
            raise ValueError(f"line {self.line}: a {self.status} result needs an error and no output")
        if self.choices is not None:
            if self.status != "succeeded" or not self.choices:
                raise ValueError(f"line {self.line}: only a succeeded result has choices, at least one")
            if [c.index for c in self.choices] != list(range(len(self.choices))):
                raise ValueError(f"line {self.line}: choices must be numbered 0, 1, ... in order")
            if self.choices[0].text != self.output:
                raise ValueError(f"line {self.line}: the output must be the text of choices[0]")
        return self

    @classmethod
    def succeeded(
        cls,
        *,
        line: int,
        id: str | None,
        output: str,
        usage: Usage,
        shard_id: str,
        attempt_id: str,
        finish_reason: FinishReason | None = None,
        choices: tuple[Choice, ...] | None = None,
    ) -> ResultRecord:
        """A record the engine answered."""
        return cls(
            line=line,
            id=id,
            status="succeeded",
            output=output,
            usage=usage,
            shard_id=shard_id,
            attempt_id=attempt_id,
            finish_reason=finish_reason,
            choices=choices,
        )

    @classmethod
    def failed(
        cls,
        *,
        line: int,
        id: str | None,
        code: str,
        message: str,
        shard_id: str,
        attempt_id: str,
        status: Literal["errored", "cancelled", "expired"] = "errored",
        usage: Usage | None = None,
    ) -> ResultRecord:
        """A record without output (``errored`` by default, or ``cancelled`` / ``expired``)."""
        return cls(
            line=line,
            id=id,
            status=status,
            error=ResultError(code=code, message=message),
            usage=usage or Usage(),
            shard_id=shard_id,
            attempt_id=attempt_id,
        )

    @classmethod
    def from_line_error(
        cls, error: LineError, *, shard_id: str = VALIDATION_SHARD_ID, attempt_id: str = VALIDATION_ATTEMPT_ID
    ) -> ResultRecord:
        """The ``errored`` outcome of an invalid input line (written by the planner)."""
        return cls.failed(
            line=error.line,
            id=error.id,
            code=error.code.value,
            message=error.message,
            shard_id=shard_id,
            attempt_id=attempt_id,
        )

    def to_json_bytes(self) -> bytes:
        """One JSONL line (without the newline), keys in docs/design.md §4.2 order.

        ``finish_reason`` and ``choices`` follow only when set (older records stay byte-identical).
        """
        error = self.error
        line: dict[str, Any] = {
            "line": self.line,
            "id": self.id,
            "status": self.status,
            "output": self.output,
            "error": None if error is None else {"code": error.code, "message": error.message},
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "completion_tokens": self.usage.completion_tokens,
            },
            "shard_id": self.shard_id,
            "attempt_id": self.attempt_id,
        }
        if self.finish_reason is not None:
            line["finish_reason"] = self.finish_reason
        if self.choices is not None:
            line["choices"] = [c.model_dump(mode="json") for c in self.choices]
        return orjson.dumps(line)

    @classmethod
    def parse_line(cls, data: bytes | str) -> ResultRecord:
        """Read one JSONL line back; raises pydantic's ``ValidationError`` (a ``ValueError``)."""
        return cls.model_validate_json(data)


def encode_results(results: Iterable[ResultRecord]) -> bytes:
    """JSON Lines bytes of result records, one line each, every line ending in a newline."""
    return b"".join(r.to_json_bytes() + b"\n" for r in results)


def encode_line_error(
    error: LineError, *, shard_id: str = VALIDATION_SHARD_ID, attempt_id: str = VALIDATION_ATTEMPT_ID
) -> bytes:
    """``encode_results([ResultRecord.from_line_error(error, ...)])``, byte for byte, without the
    models (the planner writes one per invalid line: about 8 µs through pydantic, 1 µs here)."""
    return orjson.dumps(
        {
            "line": error.line,
            "id": error.id,
            "status": "errored",
            "output": None,
            "error": {"code": error.code.value, "message": error.message},
            "usage": {"prompt_tokens": 0, "completion_tokens": 0},
            "shard_id": shard_id,
            "attempt_id": attempt_id,
        },
        option=orjson.OPT_APPEND_NEWLINE,
    )


class ModelInfo(_Frozen):
    """The model that produced the outputs, pinned by digest (null when the engine has none)."""

    name: str = Field(min_length=1)
    digest: str | None


class InputInfo(_Frozen):
    """The input snapshot; ``records`` counts its non-blank lines (each has exactly one outcome)."""

    uri: str = Field(min_length=1)
    sha256: str = Field(pattern=_SHA256)
    records: int = Field(ge=0)


class OutcomeCounts(_Frozen):
    """Terminal outcomes by status."""

    succeeded: int = Field(default=0, ge=0)
    errored: int = Field(default=0, ge=0)
    cancelled: int = Field(default=0, ge=0)
    expired: int = Field(default=0, ge=0)

    @property
    def total(self) -> int:
        return self.succeeded + self.errored + self.cancelled + self.expired


class ManifestShard(_Frozen):
    """One committed object holding outcomes (a microbatch, or the validation object)."""

    shard_id: str = Field(min_length=1)
    seq: int = Field(ge=0)
    uri: str = Field(min_length=1)
    sha256: str = Field(pattern=_SHA256)
    records: int = Field(ge=0)
    attempt_id: str = Field(min_length=1)


class SettledUsage(_Frozen):
    """What the job consumed, settled once from the usage ledger (docs/tenants.md).

    Every attempt counts, also those whose output was superseded or never committed: tokens of
    committed and uncommitted microbatches, GPU-seconds from the attempt's start to its end (or
    its last sign of life), cost at its pool's ``price_per_gpu_hour``.
    """

    tenant: str = Field(min_length=1)
    attempts: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    superseded_records: int = Field(ge=0)
    gpu_seconds: float = Field(ge=0)
    cost: float = Field(ge=0)


class OutputManifest(_Frozen):
    """The published, immutable description of a finished job's outputs (docs/design.md §4.3).

    It refuses to exist unless its counts agree: the outcomes, the records of the listed
    objects and the input's records are one and the same number (docs/design.md §4.5 invariant 1).
    """

    job_id: str = Field(min_length=1)
    manifest_version: Literal[1] = MANIFEST_VERSION
    created_at: dt.datetime
    deadline: dt.datetime
    model: ModelInfo
    prompt_template_version: str | None
    generation: dict[str, Any] = Field(default_factory=dict)
    input: InputInfo
    outcomes: OutcomeCounts
    shards: tuple[ManifestShard, ...]
    completed_at: dt.datetime
    #: the job's settled usage and cost; absent from manifests published before settlement existed
    usage: SettledUsage | None = None

    @field_validator("created_at", "deadline", "completed_at")
    @classmethod
    def _aware(cls, value: dt.datetime, info: ValidationInfo) -> dt.datetime:
        return ensure_aware(value, info.field_name or "datetime")

    @model_validator(mode="after")
    def _consistent(self) -> OutputManifest:
        listed = sum(s.records for s in self.shards)
        if not self.outcomes.total == listed == self.input.records:
            raise ValueError(
                f"manifest of job {self.job_id} is inconsistent: {self.input.records} input records, "
                f"{self.outcomes.total} outcomes, {listed} records in listed objects; they must be equal"
            )
        keys = [(s.shard_id, s.seq) for s in self.shards]
        if len(set(keys)) != len(keys):
            raise ValueError(f"manifest of job {self.job_id} lists a (shard_id, seq) twice")
        uris = [s.uri for s in self.shards]
        if len(set(uris)) != len(uris):
            raise ValueError(f"manifest of job {self.job_id} lists an object URI twice")
        return self

    def to_json_bytes(self) -> bytes:
        """Stable bytes: sorted keys, ISO-8601 UTC datetimes, two-space indent, final newline."""
        # without usage the bytes stay those of a manifest from before settlement existed
        exclude = {"usage"} if self.usage is None else None
        return orjson.dumps(
            self.model_dump(mode="json", exclude=exclude),
            option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE,
        )

    @classmethod
    def from_json_bytes(cls, data: bytes | str) -> OutputManifest:
        """Parse and check a manifest; raises pydantic's ``ValidationError`` (a ``ValueError``)."""
        return cls.model_validate_json(data)
