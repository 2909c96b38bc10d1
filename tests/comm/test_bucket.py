"""Bucket layout: one contiguous buffer per dtype, reverse registration order, a small first
bucket, gradient views shaped (and strided) like their parameters; the all-reduce handle."""

from __future__ import annotations

import pytest
import torch

from asynctron.comm import AllReduceTask, BucketManager

KiB = 1 << 10


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.Linear(32, 8))


def test_buckets_hold_parameters_in_reverse_registration_order(world_one: None) -> None:
    manager = BucketManager(model(), bucket_size_bytes=4096, first_bucket_size_bytes=1024)
    # reverse order: 3.bias 32 B, 3.weight 1 KiB (first cap 1 KiB: close), 2.bias, 2.weight
    # 4 KiB (cap 4 KiB: close), 0.bias, 0.weight (2 KiB, still open at the end)
    assert [bucket.names for bucket in manager.buckets] == [
        ("3.bias", "3.weight"), ("2.bias", "2.weight"), ("0.bias", "0.weight")]
    assert [bucket.nbytes for bucket in manager.buckets] == [
        32 + KiB, 128 + 4 * KiB, 128 + 2 * KiB]


def test_one_contiguous_buffer_per_dtype_and_views_into_it(world_one: None) -> None:
    net = model()
    net[2].to(torch.bfloat16)
    manager = BucketManager(net, bucket_size_bytes=1024, first_bucket_size_bytes=1024)
    buffers = {bucket.buffer.dtype: bucket.buffer for bucket in manager.buckets}
    assert set(buffers) == {torch.float32, torch.bfloat16}
    for bucket in manager.buckets:
        for param, view in zip(bucket.params, bucket.views, strict=True):
            assert view.shape == param.shape and view.dtype == param.dtype
            start = view.data_ptr() - bucket.buffer.data_ptr()
            assert 0 <= start < bucket.nbytes
    f32 = [b for b in manager.buckets if b.buffer.dtype == torch.float32]
    # the fp32 buckets are consecutive slices of one buffer
    assert f32[0].buffer.data_ptr() + f32[0].nbytes == f32[1].buffer.data_ptr()


def test_views_keep_the_strides_of_channels_last_parameters(world_one: None) -> None:
    conv = torch.nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
    manager = BucketManager(conv)
    views = dict(zip(manager.buckets[0].names, manager.buckets[0].views, strict=True))
    assert views["weight"].stride() == conv.weight.stride() != conv.weight.contiguous().stride()


def test_grad_dtype_float32_makes_fp32_buckets_for_bf16_parameters(world_one: None) -> None:
    manager = BucketManager(model().to(torch.bfloat16), grad_dtype=torch.float32)
    assert {bucket.buffer.dtype for bucket in manager.buckets} == {torch.float32}


async def test_start_all_reduce_returns_an_awaitable_task(world_one: None) -> None:
    manager = BucketManager(model(), bucket_size_bytes=1 << 20)
    bucket = manager.buckets[0]
    bucket.buffer.fill_(3.0)
    task = bucket.start_all_reduce()
    assert isinstance(task, AllReduceTask) and task.bucket is bucket
    await task
    await task  # awaitable again
    assert task.done() and torch.all(bucket.buffer == 3.0)
    assert task.future is not None and task.future.done()
    with pytest.raises(RuntimeError, match=r"^all-reduce of bucket 0 \(.* MiB\): result\(\) "
                                           r"called on an event loop thread"):
        task.result()
    assert "done" in repr(task) and "Bucket 0" in repr(bucket)
