"""benches/ncu_source.py: Nsight Compute's source page summed per source line."""
import csv
import io

from benches import ncu_source

HEADER = ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed", "stall_long_sb", "stall_barrier",
          "stall_long_sb (Not Issued)"]


def _page() -> str:
    """Two files as ncu writes them: a header per file, each source line's totals, then its SASS rows."""
    rows = [["File Path", "/x/kernels/topk.py"], ["Function Name", "_k"], HEADER,
            ["59", "flip = bits >> 31", "-", "-", "80", "70", "1,000", "75", "5", "60"],
            ["", "", "0x10", "  LDG.E R2, [R4]", "10", "9", "500", "9", "1", "8"],
            ["363", "tl.store(mrow + g, m)", "-", "-", "20", "18", "3000", "2", "18", "1"],
            [],
            ["File Path", "/x/triton/language/standard.py"], ["Function Name", "_k"], HEADER,
            ["170", "return core.maximum(a, b)", "-", "-", "100", "90", "250", "90", "0", "80"]]
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue()


def test_source_lines_are_read_per_file_without_their_sass_rows():
    lines = ncu_source.source_lines(list(csv.reader(io.StringIO(_page()))))
    assert [(line["file"].split("/")[-1], line["line"]) for line in lines] == [
        ("topk.py", 59), ("topk.py", 363), ("standard.py", 170)]
    first = lines[0]
    assert (first["samples"], first["instructions"]) == (80, 1000)  # "1,000" read as a number
    assert first["stalls"] == {"long_sb": 75, "barrier": 5}  # the not-issued columns left out


def test_table_ranks_lines_by_samples_with_their_share_and_reasons():
    lines = ncu_source.source_lines(list(csv.reader(io.StringIO(_page()))))
    text = ncu_source.table(lines, top=2)
    assert text[0] == "200 stall samples, 4,250 warp instructions executed"
    body = text[4:]
    assert len(body) == 2
    assert body[0].startswith("| 100 | 50.0% | 250 | standard.py:170 |") and "long_sb 90%" in body[0]
    assert body[1].startswith("| 80 | 40.0% | 1,000 | topk.py:59 |") and "long_sb 94%, barrier 6%" in body[1]
