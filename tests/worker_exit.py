"""The end of a worker script that torchrun starts (with the real DeepSpeed or with ours): every rank waits
for the others, then destroys its process groups before the interpreter exits. Without it gloo's worker
threads can outlive the interpreter's teardown and abort the process ("terminate called without an active
exception", SIGABRT) after the work succeeded: pytorch/pytorch#190489."""
import torch.distributed as dist


def end_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
