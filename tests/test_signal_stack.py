"""Ctrl-C after OpenVINO: the thread's alternate signal stack must be memory optpipe owns.

OpenVINO's CPU plugin leaves sigaltstack pointing at memory it later frees; the Ctrl-C tests
crashed with SIGSEGV when they ran after the OpenVINO tests in one process.
"""
import ctypes
import os
import signal

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from optpipe.core import signal_stack

ov = pytest.importorskip("openvino")


def _current_stack() -> signal_stack._StackT:
    current = signal_stack._StackT()
    ctypes.CDLL(None).sigaltstack(None, ctypes.byref(current))
    return current


def test_after_openvino_the_signal_stack_is_ours_and_ctrl_c_raises(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    core = ov.Core()
    first, second = core.compile_model(str(path), "CPU"), core.compile_model(str(path), "CPU")
    assert np.allclose(second(np.ones((1, 4), np.float32))[0], 1.0)
    del first, second
    signal_stack.restore_signal_stack()
    assert _current_stack().ss_sp == ctypes.addressof(signal_stack._buffer)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        signal.getsignal(signal.SIGINT)  # the handler runs at the next bytecode
