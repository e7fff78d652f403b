"""``python -m flodl.runtime.rank``: a rank process of the managed tier."""

from flodl.runtime.rank.process import end_process, main

if __name__ == "__main__":
    end_process(main())
