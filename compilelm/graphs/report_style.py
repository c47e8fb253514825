"""The inline CSS and JS of report.html (no network: nothing is fetched)."""

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em 2em;color:#222}
h1{margin:0 0 .2em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
code,pre,td{font-family:ui-monospace,monospace;font-size:12px}
pre{background:#f6f8fa;padding:6px;overflow-x:auto;margin:4px 0}
table{border-collapse:collapse;margin:.4em 0 1em}
td,th{border:1px solid #ddd;padding:2px 7px;text-align:left;vertical-align:top}
th{background:#f0f0f0;font-family:system-ui,sans-serif}
.sub{color:#666;font-weight:normal}
.pipeline{display:flex;flex-wrap:wrap;align-items:flex-start;gap:4px}
.arrow{margin-top:14px}
.stage{border:1px solid #4a78b5;border-radius:6px;padding:6px 9px;background:#eef4fc;min-width:120px;max-width:230px}
.st{font-weight:bold}.ss{color:#555;font-size:12px}.sl{font-size:12px}
.arrow{font-size:22px;color:#4a78b5}
details{margin:3px 0;border-left:3px solid #ccd;padding-left:8px}
summary{cursor:pointer}
details:target,details.hl{border-left-color:#e3a008;background:#fffbeb}
.run{margin:6px 0 10px}
table.diff{width:100%;table-layout:fixed}
table.diff td{white-space:pre-wrap;word-break:break-all;border:none;padding:0 4px}
table.diff col.ln{width:3.5em}table.diff td.ln{color:#999;text-align:right}
td.old{background:#fde8e8}td.new{background:#e6f6e6}td.empty{background:#f4f4f4}
td.fold{background:#eef;color:#557}
.del{color:#b91c1c}.add{color:#15803d}.same{color:#888}.bad{color:#b91c1c}
.piece{border:1px solid #ddd;border-radius:6px;padding:4px 12px;margin:10px 0}
table.hist td{padding:0 6px}table.hist td:last-child{width:240px}
.bar{background:#4a78b5;height:10px;min-width:2px}
.bar.gap{background:#aaa}
.src{color:#444;font-size:12px;margin:3px 0}
.two{display:flex;gap:2em}
ul.files{columns:2;font-size:12px}
"""

# Opening an anchor opens the <details> it names (and those around it) and marks it.
SCRIPT = """
function openTarget(){var id=decodeURIComponent(location.hash.slice(1));if(!id)return;
var el=document.getElementById(id);if(!el)return;
document.querySelectorAll('.hl').forEach(function(x){x.classList.remove('hl')});
if(el.tagName==='DETAILS')el.classList.add('hl');
for(var p=el;p;p=p.parentElement){if(p.tagName==='DETAILS')p.open=true;}
el.scrollIntoView();}
window.addEventListener('hashchange',openTarget);openTarget();
"""
