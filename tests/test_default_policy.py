"""The process-wide default, the scoped override, and the Keras mirror namespaces."""

import asyncio
import threading

import pytest
import torch

import dtype_policies
from dtype_policies import DTypePolicy, QuantizedDTypePolicy, config, mixed_precision


def test_default_is_float32():
    assert dtype_policies.dtype_policy() == DTypePolicy("float32")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("mixed_float16", DTypePolicy("mixed_float16")),
        ("int8_from_mixed_bfloat16", QuantizedDTypePolicy("int8", "mixed_bfloat16")),
        (DTypePolicy("bfloat16"), DTypePolicy("bfloat16")),
        (QuantizedDTypePolicy("int8", "float32"), QuantizedDTypePolicy("int8", "float32")),
        (torch.float64, DTypePolicy("float64")),
    ],
)
def test_set_dtype_policy(value, expected):
    dtype_policies.set_dtype_policy(value)
    assert dtype_policies.dtype_policy() == expected
    assert config.dtype_policy() == expected
    assert mixed_precision.global_policy() == expected


def test_set_same_policy_object_is_returned():
    policy = DTypePolicy("mixed_bfloat16")
    dtype_policies.set_dtype_policy(policy)
    assert dtype_policies.dtype_policy() is policy


def test_setting_several_times_keeps_the_last():
    for name in ["bfloat16", "float16", "mixed_float16", "float64"]:
        dtype_policies.set_dtype_policy(name)
    assert dtype_policies.dtype_policy().name == "float64"


@pytest.mark.parametrize("bad", [None, 12345, 1.5, {"name": "float32"}])
def test_set_dtype_policy_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="Invalid `policy` argument"):
        dtype_policies.set_dtype_policy(bad)
    assert dtype_policies.dtype_policy().name == "float32"


def test_invalid_name_leaves_default_unchanged():
    with pytest.raises(ValueError, match="Cannot convert"):
        dtype_policies.set_dtype_policy("mixed_float15")
    assert dtype_policies.dtype_policy().name == "float32"


def test_mirror_names():
    assert mixed_precision.Policy is DTypePolicy
    assert mixed_precision.DTypePolicy is DTypePolicy
    assert mixed_precision.set_global_policy is dtype_policies.set_dtype_policy
    assert mixed_precision.set_dtype_policy is dtype_policies.set_dtype_policy
    assert config.set_dtype_policy is dtype_policies.set_dtype_policy
    mixed_precision.set_global_policy("mixed_float16")
    assert mixed_precision.dtype_policy().name == "mixed_float16"


def test_scope_overrides_nests_and_restores():
    dtype_policies.set_dtype_policy("float64")
    with dtype_policies.policy_scope("mixed_bfloat16") as outer:
        assert outer == DTypePolicy("mixed_bfloat16")
        assert dtype_policies.dtype_policy() == outer
        with dtype_policies.policy_scope(DTypePolicy("float16")):
            assert dtype_policies.dtype_policy().name == "float16"
        assert dtype_policies.dtype_policy().name == "mixed_bfloat16"
    assert dtype_policies.dtype_policy().name == "float64"


def test_scope_restores_after_exception():
    with pytest.raises(RuntimeError), dtype_policies.policy_scope("bfloat16"):
        assert dtype_policies.dtype_policy().name == "bfloat16"
        raise RuntimeError("boom")
    assert dtype_policies.dtype_policy().name == "float32"


def test_scopes_exiting_out_of_order_leave_the_later_scope_in_force():
    """A generator suspended inside a scope finishes inside one its caller
    opened later: the caller's stays in force, and every exit leaves the
    default as it was before the scopes."""

    def generator():
        with dtype_policies.policy_scope("bfloat16"):
            yield dtype_policies.dtype_policy().name
            yield dtype_policies.dtype_policy().name

    steps = generator()
    assert next(steps) == "bfloat16"
    with dtype_policies.policy_scope("float16"):
        assert dtype_policies.dtype_policy().name == "float16"  # the innermost opened
        next(steps)
        assert next(steps, None) is None  # the generator's scope exits here
        assert dtype_policies.dtype_policy().name == "float16"
    assert dtype_policies.dtype_policy().name == "float32"
    dtype_policies.set_dtype_policy("float64")
    assert dtype_policies.dtype_policy().name == "float64"


def test_a_scope_exited_in_another_thread_is_no_longer_in_force_where_it_was_entered():
    def suspended():
        with dtype_policies.policy_scope("bfloat16"):
            yield

    generator = suspended()
    next(generator)  # entered here
    assert dtype_policies.dtype_policy().name == "bfloat16"
    closer = threading.Thread(target=generator.close)  # exited there
    closer.start()
    closer.join()
    assert generator.gi_frame is None
    assert dtype_policies.dtype_policy().name == "float32"
    with dtype_policies.policy_scope("mixed_float16"):  # later scopes work as before
        assert dtype_policies.dtype_policy().name == "mixed_float16"
    assert dtype_policies.dtype_policy().name == "float32"


def test_a_task_created_inside_a_scope_keeps_it_for_its_whole_run():
    async def child(event, seen):
        seen.append(dtype_policies.dtype_policy().name)
        await event.wait()
        seen.append(dtype_policies.dtype_policy().name)

    async def main():
        event, seen = asyncio.Event(), []
        with dtype_policies.policy_scope("mixed_bfloat16"):
            task = asyncio.create_task(child(event, seen))
            await asyncio.sleep(0)
        assert dtype_policies.dtype_policy().name == "float32"
        event.set()
        await task
        return seen

    assert asyncio.run(main()) == ["mixed_bfloat16", "mixed_bfloat16"]


def test_scope_rejects_bad_values_without_entering():
    with (
        pytest.raises(ValueError, match="Invalid `policy` argument"),
        dtype_policies.policy_scope(None),
    ):
        pass
    assert dtype_policies.dtype_policy().name == "float32"


def test_set_inside_scope_changes_global_but_scope_wins():
    with dtype_policies.policy_scope("bfloat16"):
        dtype_policies.set_dtype_policy("float64")
        assert dtype_policies.dtype_policy().name == "bfloat16"
    assert dtype_policies.dtype_policy().name == "float64"


def test_scope_is_isolated_across_threads():
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def scoped_thread():
        with dtype_policies.policy_scope("mixed_bfloat16"):
            seen["scoped"] = dtype_policies.dtype_policy().name
            inside.set()
            release.wait(5)

    def other_thread():
        inside.wait(5)
        seen["other"] = dtype_policies.dtype_policy().name
        release.set()

    threads = [threading.Thread(target=scoped_thread), threading.Thread(target=other_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == {"scoped": "mixed_bfloat16", "other": "float32"}


def test_global_is_shared_across_threads():
    dtype_policies.set_dtype_policy("bfloat16")
    seen = []
    thread = threading.Thread(target=lambda: seen.append(dtype_policies.dtype_policy().name))
    thread.start()
    thread.join(5)
    assert seen == ["bfloat16"]


def test_scope_is_isolated_across_asyncio_tasks():
    async def scoped(name, started, proceed):
        with dtype_policies.policy_scope(name):
            started.set()
            await proceed.wait()
            return dtype_policies.dtype_policy().name

    async def unscoped(started, proceed):
        await started.wait()
        name = dtype_policies.dtype_policy().name
        proceed.set()
        return name

    async def main():
        started_a, started_b, proceed = asyncio.Event(), asyncio.Event(), asyncio.Event()
        both_started = asyncio.Event()

        async def wait_both():
            await started_a.wait()
            await started_b.wait()
            both_started.set()

        return await asyncio.gather(
            scoped("bfloat16", started_a, proceed),
            scoped("float16", started_b, proceed),
            unscoped(both_started, proceed),
            wait_both(),
        )

    results = asyncio.run(main())
    assert results[:3] == ["bfloat16", "float16", "float32"]
