"""Jinja2 templates of the generated deployment package (rendered by `dspark.compiler`)."""
