<#
.SYNOPSIS
  Per-process GPU memory on Windows (AMD Strix Halo's Radeon 8060S and any WDDM GPU), from the
  "GPU Process Memory" performance counters, sampled into a CSV.

.DESCRIPTION
  Every -Every seconds (30 by default) appends one row for process -ProcessId: dedicated and
  shared GPU memory (the counters' Dedicated Usage and Shared Usage, summed over the process's
  adapters) and its working set, until the process exits or Ctrl+C. On an APU the shared figure
  is the one that grows: unified memory is handed out as shared GPU memory. The CSV's columns
  are those of tools/mem_sampler.py, so one plot reads both; the allocator's own figures
  (device_allocated_bytes, device_reserved_bytes) are only visible inside the process and stay
  empty here.

.EXAMPLE
  # start (in a second PowerShell window, with the training's PID from Task Manager or the trainer's log):
  powershell -ExecutionPolicy Bypass -File tools\gpu_mem_sampler.ps1 -ProcessId 1234 -Out gpu_mem.csv
  # stop: Ctrl+C, or it stops by itself when the process exits
#>
param(
    [Parameter(Mandatory = $true)][int]$ProcessId,
    [string]$Out = "gpu_mem.csv",
    [ValidateRange(1, 86400)][int]$Every = 30,
    [int]$Count = 0
)

$ErrorActionPreference = "Stop"
$fields = "time_utc,elapsed_s,pid,rss_bytes,gpu_dedicated_bytes,gpu_shared_bytes,device_allocated_bytes,device_reserved_bytes"

if (-not (Get-Process -Id $ProcessId -ErrorAction SilentlyContinue)) {
    Write-Error "gpu_mem_sampler: no process with PID $ProcessId"
    exit 1
}
if (-not (Test-Path $Out) -or (Get-Item $Out).Length -eq 0) {
    $usage = "# gpu_mem_sampler: pid $ProcessId every $Every s. start: powershell -ExecutionPolicy Bypass " +
             "-File tools\gpu_mem_sampler.ps1 -ProcessId $ProcessId -Out $Out; stop: Ctrl+C, or it stops when the process exits"
    Set-Content -Path $Out -Value $usage -Encoding ascii
    Add-Content -Path $Out -Value $fields -Encoding ascii
}

# Counter instances look like pid_1234_luid_0x00000000_0x0000D1E6_phys_0: one per adapter.
$paths = @("\GPU Process Memory(pid_${ProcessId}_*)\Dedicated Usage",
           "\GPU Process Memory(pid_${ProcessId}_*)\Shared Usage")

function Sum-Counter($samples, $name) {
    $total = [int64]0
    foreach ($s in $samples) {
        if ($s.Path -like "*\$name") { $total += [int64]$s.CookedValue }
    }
    return $total
}

$start = Get-Date
$rows = 0
Write-Host "gpu_mem_sampler: PID $ProcessId every $Every s into $Out; Ctrl+C stops"
while ($true) {
    $proc = Get-Process -Id $ProcessId -ErrorAction SilentlyContinue
    if (-not $proc) { break }
    $dedicated = ""
    $shared = ""
    try {
        $samples = (Get-Counter -Counter $paths -ErrorAction Stop).CounterSamples
        $dedicated = Sum-Counter $samples "dedicated usage"
        $shared = Sum-Counter $samples "shared usage"
    } catch {
        # no GPU counters for this process yet (it has not touched the GPU): leave them empty
    }
    $now = (Get-Date).ToUniversalTime().ToString("yyyy-MM-ddTHH:mm:ss+00:00")
    $elapsed = "{0:F1}" -f ((Get-Date) - $start).TotalSeconds
    Add-Content -Path $Out -Value "$now,$elapsed,$ProcessId,$($proc.WorkingSet64),$dedicated,$shared,," -Encoding ascii
    $rows += 1
    if ($Count -gt 0 -and $rows -ge $Count) { break }
    Start-Sleep -Seconds $Every
}
Write-Host "gpu_mem_sampler: $rows samples written to $Out"
