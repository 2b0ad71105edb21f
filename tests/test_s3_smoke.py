import pytest
import torch

import ckpt


def test_single_process_save_and_restore_on_s3(s3_root):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with ckpt.Checkpointer(s3_root, model=m, optimizer=opt, interval=ckpt.Every(steps=2)) as cp:
        for _ in range(cp.step, 4):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
    want = m.weight.detach().clone()
    m2 = torch.nn.Linear(4, 4)
    with ckpt.Checkpointer(s3_root, model=m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1)) as cp:
        assert cp.step == 4
    assert torch.equal(m2.weight, want)


def test_a_bucket_that_does_not_exist_is_a_storage_error_not_a_fresh_start(s3_env):
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ckpt.StorageError, match="does not exist"):
        with ckpt.Checkpointer("s3://no-such-bucket-ckpt/run", model=m):
            pass
