"""specjax's programs compile with its XLA CPU options (`specjax.xla_options`)."""
import jax
import jax.numpy as jnp
import pytest

from specjax import auto_costs, loop, refill, xla_options
from specjax.measure import profile
from specjax.xla_options import CPU_OPTIONS, Program, compile_options, program

SCHEDULER = "xla_cpu_enable_concurrency_optimized_scheduler"
SCHEDULER_TYPE = "xla_cpu_scheduler_type"
FUSION_EMITTERS = "xla_cpu_use_fusion_emitters"


def test_the_options_are_xla_cpus_and_a_users_xla_flags_win():
    assert compile_options("cpu") == CPU_OPTIONS == {
        SCHEDULER: False, SCHEDULER_TYPE: "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
        FUSION_EMITTERS: False}
    assert compile_options("gpu") == {} and compile_options("tpu") == {}
    users = f"--xla_force_host_platform_device_count=8 --{SCHEDULER}=true"
    assert compile_options("cpu", users) == {SCHEDULER_TYPE: "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                                             FUSION_EMITTERS: False}
    assert compile_options(
        "cpu", f"{users} --{SCHEDULER_TYPE}=CPU_SCHEDULER_TYPE_DEFAULT --{FUSION_EMITTERS}=true") == {}
    assert compile_options("cpu", "--xla_force_host_platform_device_count=8") == CPU_OPTIONS


@pytest.mark.parametrize("name, bad_value", [(SCHEDULER, "not-a-bool"),
                                              (SCHEDULER_TYPE, "CPU_SCHEDULER_TYPE_BOGUS"),
                                              (FUSION_EMITTERS, "not-a-bool")])
def test_a_program_compiles_with_the_options(monkeypatch, name, bad_value):
    """The options reach XLA: an invalid value fails the compile, naming the option, both in
    the probe of `supported_options` and (the probe passing it on) in the program's own."""
    monkeypatch.setattr(xla_options, "CPU_OPTIONS", CPU_OPTIONS | {name: bad_value})
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(Exception, match=name):
        program(lambda x: x + 1)(jnp.ones(3))
    monkeypatch.setattr(xla_options, "supported_options", dict)  # no probe: the program's compile
    with pytest.raises(Exception, match=name):
        program(lambda x: x + 1)(jnp.ones(3))


def test_an_option_this_xla_lacks_is_left_out_with_a_warning(monkeypatch):
    """XLA's options come and go between jaxlib releases: one it lacks must not fail a program."""
    monkeypatch.setattr(xla_options, "CPU_OPTIONS", CPU_OPTIONS | {"xla_cpu_no_such_option": True})
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.warns(UserWarning, match="xla_cpu_no_such_option is not in this jaxlib"):
        assert xla_options.current_options() == CPU_OPTIONS
    assert float(program(lambda x: x + 1)(jnp.ones(()))) == 2.0


def test_a_program_behaves_as_its_jit():
    @program(static_argnames=("n",), donate_argnames=("x",))
    def scaled(x, n):
        """Doubles n times."""
        for _ in range(n):
            x = x * 2
        return x

    assert scaled.__doc__ == "Doubles n times." and scaled._cache_size() == 0
    assert float(scaled(jnp.ones(()), n=3)) == 8.0 and scaled._cache_size() == 1
    assert float(scaled(jnp.ones(()), n=3)) == 8.0 and scaled._cache_size() == 1
    assert float(scaled(jnp.ones(()), n=1)) == 2.0 and scaled._cache_size() == 2
    assert "mul" in scaled.lower(jnp.ones(()), n=2).as_text()
    assert "mul" in scaled.trace(jnp.ones(()), n=2).lower().as_text()
    assert scaled.eval_shape(jnp.ones((2,)), n=1).shape == (2,)
    assert jax.eval_shape(lambda x: scaled(x, n=1), jnp.ones((2,))).shape == (2,)
    assert float(jax.jit(lambda x: scaled(x, n=2))(jnp.ones(()))) == 4.0  # inside another jit
    assert float(jax.jit(lambda: scaled(jnp.ones(()), n=2))()) == 4.0  # ... on constants only
    assert jax.vmap(lambda x: scaled(x, n=1))(jnp.arange(3.0)).tolist() == [0.0, 2.0, 4.0]
    assert float(jax.grad(lambda x: scaled(x, n=2))(1.0)) == 4.0


def test_the_decoding_and_profiling_programs_are_programs():
    programs = [loop.generate_program, loop.spec_generate_program, loop.ar_start_program,
                loop.ar_finish_program, loop.spec_start_program, loop.spec_finish_program,
                refill.slots_program, refill.refill_program, auto_costs._forced_steps,
                auto_costs._rewound_steps]
    profilers = [value for value in vars(profile).values() if isinstance(value, Program)]
    assert all(isinstance(p, Program) for p in programs) and len(profilers) == 6
