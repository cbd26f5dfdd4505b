"""The ``transfer`` section: the cluster secret, data paths, staging, leases, deadlines, UCX settings,
the failure policy and fault injection of the KV transfer."""

from __future__ import annotations

import difflib
import ipaddress
import re
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from cluster.config.base import Section, check_fields

FAULT_POINTS = ("connect", "before_data", "mid_data", "before_ack")
SECRET_ENV = "DUET_TRANSFER_SECRET"
# A prefill worker proves the secret (an HMAC over a nonce) to whoever connects before that peer
# proves anything, so a peer without it can test guesses offline: a secret must be long and random.
MIN_SECRET_CHARS = 32


def secret_problem(secret: str) -> str | None:
    """Why ``secret`` cannot be the cluster's transfer secret, or None."""
    if len(secret) < MIN_SECRET_CHARS:
        return (
            f"must be at least {MIN_SECRET_CHARS} characters of random text (a peer can test "
            "guesses of it offline), e.g. python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'"
        )
    return None


_UCX_TRANSPORT = re.compile(r"\^?[a-z][a-z0-9_]*")
# UCX's transport names and aliases (UCX 1.21: ucp_context.c and its uct components). UCX only warns
# about a name it does not know and runs without it, so a typo ("cuda_ipcc") would silently move
# the KV over TCP instead: a name close to one of these but not one of them is refused. A name far
# from all of them (a transport newer than this list) is passed on to UCX as it is.
_UCX_NAMES = frozenset(
    "all self tcp sm shm mm posix sysv xpmem knem cma ib rc rc_v rc_x rc_verbs rc_mlx5 ud ud_v "
    "ud_x ud_verbs ud_mlx5 dc dc_x dc_mlx5 srd rdmacm sockcm cuda cuda_copy cuda_ipc gdr_copy "
    "rocm rocm_copy rocm_ipc rocm_gdr ze ze_copy ze_ipc ze_gpu ugni ugni_smsg ugni_udt "
    "ugni_rdma".split()
)


def _ucx_typo(name: str) -> str | None:
    """The known UCX transport ``name`` is a typo of, or None."""
    bare = name.removeprefix("^")
    if bare in _UCX_NAMES:
        return None
    close = difflib.get_close_matches(bare, _UCX_NAMES, n=1, cutoff=0.75)
    return close[0] if close else None


def _as_text(value: Any) -> Any:
    """A YAML scalar as UCX writes it (booleans y / n); anything else as it is (checked later)."""
    if isinstance(value, bool):
        return "y" if value else "n"
    return str(value) if isinstance(value, int | float) else value


def _deadline(default: float, what: str) -> Any:
    return Field(
        default, gt=0, description=f"Seconds to wait for {what} before failing the request."
    )


class FaultInjectionConfig(Section):
    """Fail a chosen fraction of KV pulls on purpose, where the real transport would fail: for
    tests, and for rehearsing failures (with ``on_failure``). Off by default."""

    fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description=(
            "Fraction of pulls that fail (0 = off, 1 = every pull). With tensor parallelism each "
            "decode rank's part of a request is a pull of its own, drawn apart: a request of N "
            "parts fails with about 1 - (1 - fraction)^N, and each failed part is counted."
        ),
    )
    points: tuple[Literal["connect", "before_data", "mid_data", "before_ack"], ...] = Field(
        FAULT_POINTS,
        min_length=1,
        description=(
            "Where a chosen pull fails, one of these each: connect (connecting to the prefill "
            "worker), before_data (the prefill worker refuses it before any page), mid_data "
            "(about half of the pages landed), before_ack (every page landed and was checked)."
        ),
    )
    seed: int = Field(
        0,
        description=(
            "Which pulls fail: the same seed and request ids fail the same pulls. Over HTTP a "
            "rerun fails a like share, not the same requests: the server gives each request an "
            "id of its own (the client's X-Request-Id or request_id, then a unique tail)."
        ),
    )


class TransferConfig(Section):
    """How a decode worker pulls a request's KV cache from a prefill worker. Every wait has a
    deadline, so a lost message ends in an error rather than a hang."""

    secret: SecretStr | None = Field(
        None,
        description=(
            "The cluster's shared secret: workers prove it to each other (HMAC challenge-response) "
            "before any page table, address or pool export is sent. Unset: the "
            f"{SECRET_ENV} environment variable, or else `duet serve` makes a fresh one per "
            "cluster and hands it to the workers."
        ),
    )
    on_failure: Literal["fail", "recompute"] = Field(
        "fail",
        description=(
            "What a decode worker does when a pull fails, expires or is refused: fail the request "
            "(the client gets an error), or recompute it (prefill the prompt itself, then decode "
            "on: the client gets a normal completion). vLLM's kv_load_failure_policy."
        ),
    )
    fault_injection: FaultInjectionConfig = Field(
        default_factory=FaultInjectionConfig, description="Pulls to fail on purpose."
    )
    staging_tokens: int = Field(
        4096,
        gt=0,
        description=(
            "Tokens per UCX transfer chunk (the staging buffer's size); a multiple of "
            "kvcache.page_size. Longer prompts go in several pipelined chunks. Staging takes "
            "staging_buffers x staging_tokens x the KV bytes of a token on each worker, outside "
            "the KV budget, made on its first UCX pull (direct reads never stage)."
        ),
    )
    staging_buffers: int = Field(
        4,
        ge=1,
        description=(
            "Staging buffers per worker, shared by its UCX pulls (each one chunk of "
            "staging_tokens; made on the first UCX pull, outside the KV budget)."
        ),
    )
    direct_copy: bool = Field(
        True,
        description=(
            "When a prefill and a decode worker run on one host, the decode worker reads the "
            "prefill worker's KV pages itself (GPUs: CUDA IPC and one copy kernel; CPU: the "
            "pools' shared memory, mapped read-only), holding the prefill worker's lease for the "
            "read, instead of receiving them over UCX. Other pairs use UCX either way."
        ),
    )
    lease_s: float = Field(
        30.0,
        gt=0,
        description=(
            "How long a prefill worker pins a finished request's pages for a decode worker to "
            "pull them; then, still unpulled, they are released. A pull that has begun is never "
            "cut by it: the pages go when the pull ends (the decode worker's final notice or its "
            "failure; with neither, ack_deadline_s after the data, and a direct read "
            "chunk_deadline_s + ack_deadline_s after its grant)."
        ),
    )
    connect_deadline_s: float = _deadline(10.0, "a connection to a peer (with its handshake)")
    pull_deadline_s: float = Field(
        30.0,
        gt=0,
        description=(
            "Seconds to wait for the first chunk after sending a pull request before failing "
            "the request. A direct read waits this long for the prefill worker's grant, but "
            "never past the read's window (chunk_deadline_s + ack_deadline_s from its request, "
            "within which the grant and the copy must both fall)."
        ),
    )
    chunk_deadline_s: float = _deadline(10.0, "each following chunk (and for a direct read's copy)")
    done_deadline_s: float = _deadline(10.0, "TransferDone after the last chunk")
    ack_deadline_s: float = _deadline(10.0, "the decode worker's final notice after the data")
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description=(
            "Address each prefill worker's control (TCP) listener binds to and advertises in its "
            "tickets (excludes interface). One value serves every node: across hosts, set "
            "interface instead."
        ),
    )
    interface: str | None = Field(
        None,
        min_length=1,
        description=(
            "Network interface whose address each prefill worker's listener binds to (e.g. "
            '"eth0"), looked up on the worker\'s own node; excludes host. Decode workers only '
            "dial: they do not need it."
        ),
    )
    progress_mode: Literal["auto", "loop", "thread", "thread-polling"] = Field(
        "auto",
        description=(
            "How UCX is progressed: loop (by the worker's event loop, polling only while KV "
            "messages are in flight: no thread, no idle CPU), thread (a progress thread that "
            "sleeps until woken), thread-polling (a spinning thread: lower latency per message, "
            "one busy core), or auto: thread with direct_copy on (pairs of one host read "
            "directly and UCX only sleeps; pairs across hosts get the same thread), else loop "
            "for KV in host memory and thread-polling for KV on a GPU."
        ),
    )
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description=(
            "A prefill worker's listener port; 0 = any free port. With "
            "prefill.tensor_parallel_size N its rank r listens on port + r (ports port .. "
            "port + N - 1)."
        ),
    )
    ucx_tls: tuple[str, ...] | None = Field(
        None,
        description=(
            'UCX_TLS as a list, e.g. ["cuda_ipc", "cuda_copy", "tcp"]; a leading ^ excludes. '
            "None = UCX picks."
        ),
    )
    ucx_net_devices: str | None = Field(
        None,
        min_length=1,
        description=(
            'UCX_NET_DEVICES, e.g. "lo" or "mlx5_0:1". None = "lo" where host is a loopback '
            "address (a cluster of one host: UCX listens on no other interface), else UCX picks."
        ),
    )
    ucx_env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Further UCX_* environment variables for the workers' UCX contexts. Unset, "
            "UCX_TCP_TX_SEG_SIZE is 64k instead of UCX's 8k (faster pulls over TCP)."
        ),
    )

    @field_validator("ucx_tls")
    @classmethod
    def _transport_names(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None:
            if not value:
                raise ValueError("must name at least one transport, or be left out")
            bad = [name for name in value if not _UCX_TRANSPORT.fullmatch(name)]
            if bad:
                raise ValueError(
                    f"transport names are lower-case words like 'tcp' or 'cuda_ipc', got {bad}"
                )
            typos = [(name, close) for name in value if (close := _ucx_typo(name))]
            if typos:
                said = ", ".join(f"{k!r} (did you mean {v!r}?)" for k, v in typos)
                raise ValueError(
                    f"not UCX transports: {said}; UCX would only warn and run without them"
                )
            if any(name.startswith("^") for name in value[1:]):
                raise ValueError(
                    "a leading ^ excludes the whole list: put it on the first name only"
                )
            # (a leading ^ excludes every name of the list)
            excluded = value[0].startswith("^")
            named = bool({"tcp", "all"} & {value[0].removeprefix("^"), *value[1:]})
            if named == excluded:  # tcp excluded, or not included
                must = "not exclude" if excluded else "include"
                raise ValueError(
                    f"must {must} 'tcp': the endpoints use peer error handling, under which UCX "
                    "leaves out shared memory, and tcp carries the connection set-up"
                )
        return value

    @field_validator("secret")
    @classmethod
    def _not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value():
            raise ValueError(
                f"must not be empty: leave it out to use {SECRET_ENV} or a secret `duet serve` "
                "makes"
            )
        if value is not None and (problem := secret_problem(value.get_secret_value())):
            raise ValueError(problem)
        return value

    @field_validator("host")
    @classmethod
    def _routable(cls, value: str) -> str:
        if value in ("0.0.0.0", "::"):
            raise ValueError(
                "is advertised to decode workers in tickets, so it must be an address they can "
                "dial: give one, or set interface"
            )
        return value

    @field_validator("ucx_env", mode="before")
    @classmethod
    def _scalars_as_text(cls, value: Any) -> Any:
        # YAML reads 1 or yes as numbers and booleans; UCX takes every setting as text.
        if isinstance(value, dict):
            return {k: _as_text(v) for k, v in value.items()}
        return value

    @field_validator("ucx_env")
    @classmethod
    def _ucx_variables_only(cls, value: dict[str, str]) -> dict[str, str]:
        bad = sorted(name for name in value if not name.startswith("UCX_"))
        if bad:
            raise ValueError(f"keys must start with 'UCX_', got {bad}")
        own = sorted({"UCX_TLS", "UCX_NET_DEVICES"} & value.keys())
        if own:
            raise ValueError(f"{own} have their own fields (ucx_tls, ucx_net_devices)")
        return value

    @model_validator(mode="after")
    def _check(self) -> TransferConfig:
        issues: list[tuple[str, str]] = []
        if self.interface is not None and "host" in self.model_fields_set:
            issues.append(("interface", "not allowed together with host (pick one)"))
        longest = max(self.connect_deadline_s, self.pull_deadline_s)
        if self.lease_s < longest:
            issues.append(
                (
                    "lease_s",
                    f"must be >= connect_deadline_s and pull_deadline_s ({longest}): a shorter "
                    f"lease can expire while the decode worker is still within its deadline, "
                    f"got {self.lease_s}",
                )
            )
        check_fields(issues)
        return self

    @property
    def ucx_environment(self) -> dict[str, str]:
        """Every UCX_* variable to set in a worker before its UCX context starts."""
        env = dict(self.ucx_env)
        if self.ucx_tls is not None:
            env["UCX_TLS"] = ",".join(self.ucx_tls)
        if self.ucx_net_devices is not None:
            env["UCX_NET_DEVICES"] = self.ucx_net_devices
        elif self.interface is None and _loopback(self.host):
            env["UCX_NET_DEVICES"] = "lo"
        return env


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # (a host name)
        return False
