"""The dspark runtime library that generated deployment packages run on.

Importing this package does not import torch (the compiler reads `dspark.runtime.config`);
the modules that need torch import it themselves.
"""
