"""Reports every Triton kernel variant compiled after start-up, which is meant to compile every
variant serving reaches (a late one makes its request wait for the compiler): chains Triton's
post-compile hook, logs each variant once with its specialisation, keeps the list for benchmarks
and tests. Diagnostics only: a missing or failing hook never stops a compile; the interpreter
(CPU) compiles nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ferrum.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True, slots=True)
class CompiledVariant:
    kernel: str  # the @triton.jit function's qualified name
    description: str  # the kernel's arguments as specialised (describe_variant)


class CompileWatch:
    """Collects the variants compiled while armed, over the life of the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed = False
        self._variants: list[CompiledVariant] = []
        self._hook: Callable[..., Any] | None = None

    def install(self) -> bool:
        """Chains `record` into Triton's post-compile hook, again if something replaced it since;
        False where this Triton has no such hook (each runner's start-up logs it once)."""
        with self._lock:
            try:
                from triton import knobs

                current = knobs.runtime.jit_post_compile_hook
            except (ImportError, AttributeError):
                logger.info("this Triton has no post-compile hook: compiles are not watched")
                return False
            if self._hook is not None and current is self._hook:
                return True
            previous = current

            def hook(**kwargs: Any) -> Any:
                # Only the newest link records: an older one may still be called through a
                # hook that wrapped it before this install.
                if self._hook is hook:
                    try:
                        self.record(kwargs["fn"].name, describe_variant(kwargs))
                    except Exception:  # diagnostics must never fail a compile
                        logger.debug("compile watch: could not record a compile", exc_info=True)
                return previous(**kwargs) if previous is not None else None

            knobs.runtime.jit_post_compile_hook = hook
            self._hook = hook
            return True

    def arm(self) -> None:
        """From now on every compiled variant counts as compiled while serving."""
        with self._lock:
            self._armed = True

    def disarm(self) -> None:
        """A runner of this process is starting up: its compiles are start-up's."""
        with self._lock:
            self._armed = False

    def record(self, kernel: str, description: str) -> None:
        with self._lock:
            if not self._armed:
                return
            self._variants.append(CompiledVariant(kernel, description))
        logger.warning(
            "Triton compiled %s while serving: start-up did not warm this variant up, so the "
            "step that needed it waited for the compiler (%s)",
            kernel,
            description,
        )

    def variants(self) -> list[CompiledVariant]:
        """Every variant compiled while armed in this process, in compile order."""
        with self._lock:
            return list(self._variants)


def describe_variant(hook_kwargs: dict[str, Any]) -> str:
    """`kernel(arg: type, ...)` from the hook's arguments: a constexpr (and an integer
    specialised to 1) as `name=value`, an argument specialised as 16-aligned (a pointer) or a
    multiple of 16 (an integer) marked `%16`. Triton's own repr when its layout is unknown."""
    try:
        compile_info = hook_kwargs["compile"]
        signature: dict[str, str] = compile_info["signature"]
        constants: dict[tuple[int, ...], Any] = compile_info["constants"]
        attrs: dict[tuple[int, ...], Any] = compile_info["configs"][0]
        parts = []
        for i, (name, ty) in enumerate(signature.items()):
            if (i,) in constants:
                parts.append(f"{name}={constants[(i,)]}")
            else:
                parts.append(f"{name}: {ty}{' %16' if attrs.get((i,)) else ''}")
        return f"{hook_kwargs['fn'].name}({', '.join(parts)})"
    except (KeyError, IndexError, TypeError, AttributeError):
        return str(hook_kwargs.get("repr"))


# Triton's hook is process-wide, so the watch is too.
COMPILE_WATCH = CompileWatch()


def start_up_compiles() -> None:
    """Called by the model runner when it starts building (and again before its warm-up)."""
    COMPILE_WATCH.disarm()


def watch_serving_compiles() -> None:
    """Called by the model runner when start-up has compiled what it will: (re)installs the
    hook and arms it."""
    if COMPILE_WATCH.install():
        COMPILE_WATCH.arm()


def compiled_while_serving() -> list[CompiledVariant]:
    return COMPILE_WATCH.variants()
