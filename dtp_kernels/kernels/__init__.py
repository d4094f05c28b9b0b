"""Triton kernels (layer 1 of docs/design.md section 5): no autograd, no nn.Module.

Importing this package needs triton; dtp_kernels imports it only when a Triton backend
is used. On CPU tensors the kernels run under TRITON_INTERPRET=1.
"""
