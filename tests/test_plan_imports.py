"""``fsdp-course plan`` imports torch, transformers and the model's code without the cyclic
garbage collector (``utilities.imports``): the collector is on again for the tracked step, and
after the command as before; the plan is the same to the byte."""

import contextlib
import gc
import io

from utilities.imports import collect_from_here, paused_collection


def test_the_collector_is_paused_until_the_step_and_on_after():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with paused_collection():
            assert not gc.isenabled()
            collect_from_here()
            assert gc.isenabled() and gc.get_freeze_count() > frozen
            collect_from_here()  # once only: the second trace of a sweep changes nothing
        assert gc.isenabled()
        with paused_collection():
            pass  # a command that traces nothing (--help, a refused flag)
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_a_caller_who_turned_the_collector_off_keeps_it_off():
    gc.disable()
    try:
        with paused_collection():
            collect_from_here()
            assert not gc.isenabled()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_the_plan_through_the_command_is_the_plan_without_the_pause():
    from utilities.course import cli
    from utilities.measure import fake_step, plan_cli

    argv = ["--model", "llama-tiny", "--gpus", "2", "--seq", "64", "--json"]
    outputs = []
    try:
        for run in (lambda: cli.main(["plan", *argv]), lambda: plan_cli.main(argv)):
            fake_step.clear_cache()  # each traces its own step
            with contextlib.redirect_stdout(io.StringIO()) as out:
                assert run() == 0
            outputs.append(out.getvalue())
            assert gc.isenabled()
    finally:
        gc.unfreeze()
    assert outputs[0] == outputs[1] and '"tracker_allocated"' in outputs[0]
