"""Host sparse-attention benchmark (same as `python -m nelssa.bench.sparse_attention`)."""

from nelssa.bench.sparse_attention import main

if __name__ == "__main__":
    main()
