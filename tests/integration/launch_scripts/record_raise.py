"""Worker: an entry point decorated with torch's @record that raises.

@record writes the exception to $TORCHELASTIC_ERROR_FILE, which the launcher sets per rank and
quotes in its failure summary.
"""

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    raise ValueError("bad batch 7 on purpose")


if __name__ == "__main__":
    main()
