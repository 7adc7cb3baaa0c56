<#
.SYNOPSIS
    Samples per-process GPU memory (dedicated, shared, local, non-local) on Windows and appends CSV rows.

.DESCRIPTION
    Reads Windows' GPU performance counters every -IntervalSeconds seconds (30 by default) for one
    process (-Pid), the processes with a given name (-ProcessName, default 'python') or every process
    that holds GPU memory (-All), and writes one CSV row per process and sample:

        timestamp,pid,process,dedicated,shared,local,non_local

    All four memory columns are bytes. The timestamp is ISO-8601 local time with its UTC offset.
    Works for any WDDM 2.x GPU driver (NVIDIA/CUDA, AMD/ROCm, Intel) on Windows 10 1709 or later,
    in Windows PowerShell 5.1 and PowerShell 7.

    Source: the language-neutral WMI class
    Win32_PerfFormattedData_GPUPerformanceCounters_GPUProcessMemory (through Get-CimInstance). Its
    instances are named pid_<pid>_luid_<adapter>_phys_<n>; a process that uses several adapters or
    physical GPUs has several instances, and this script sums them into one row per pid. Where the
    WMI class is missing, it falls back to Get-Counter '\GPU Process Memory(*)\Dedicated Usage' (and
    Shared / Local / Non Local Usage), whose counter names only exist on English Windows.

    Only processes that hold GPU memory appear in the counters, so a matching process that has not
    touched the GPU yet gives no row. Rows go to the output stream (the console, or a pipe) and, with
    -OutFile, are appended to that file; the header is written once, when the file is new or empty.
    Progress messages go to the host, not the output stream, so redirecting the output keeps a clean CSV.

    The sampler stops on Ctrl-C (with a message saying how many samples it took), after -Count
    samples, or - with -Pid - when that process exits. Exit status 2: a bad argument, no such
    process at the start, or no GPU counter source.

.PARAMETER ProcessId
    The id of the one process to sample (alias -Pid; the variable $PID is reserved in PowerShell).
    Sampling ends with a message when the process exits.

.PARAMETER ProcessName
    Sample every process with this name (default 'python'). The name is matched like Get-Process
    -Name: case-insensitive, wildcards allowed, without '.exe'. A plain name also matches that name
    followed by a version, so 'python' matches python.exe, python3.exe and python3.11.exe.

.PARAMETER All
    Sample every process that holds GPU memory.

.PARAMETER IntervalSeconds
    Seconds between samples (default 30; 0 samples back to back).

.PARAMETER Count
    Take this many samples, then exit (default 0: run until Ctrl-C). For scripted use.

.PARAMETER OutFile
    Append the CSV rows to this file too. The header is written only when the file is new or empty.

.EXAMPLE
    .\tools\gpu_mem_sampler.ps1 -OutFile gpu_mem.csv

    Every 30 s, one row per python process that holds GPU memory, on the console and appended to gpu_mem.csv.

.EXAMPLE
    .\tools\gpu_mem_sampler.ps1 -Pid 12345 -IntervalSeconds 5 -OutFile run1_gpu.csv

    Follows process 12345 every 5 s and ends by itself when the process exits.

.EXAMPLE
    .\tools\gpu_mem_sampler.ps1 -All -Count 1

    One sample of every process that holds GPU memory, then exit.

.EXAMPLE
    powershell -ExecutionPolicy Bypass -File tools\gpu_mem_sampler.ps1 -ProcessName python -Count 10 -IntervalSeconds 1 > sample.csv

    Ten samples one second apart, the CSV captured from the output stream.

.OUTPUTS
    System.String. The CSV header, then one CSV line per process and sample.

.NOTES
    Part of minagi (issue 4). The Linux twin is tools/gpu_mem_sampler.sh, with the same CSV columns.
    Dedicated = memory in the GPU's own (dedicated) segment; Shared = system memory the GPU uses
    (on an APU such as Strix Halo most of a process' memory may be here); Local / Non Local =
    memory in the adapter's local / non-local segments as the driver reports them.
#>

[CmdletBinding(DefaultParameterSetName = 'ByName')]
param(
    [Parameter(ParameterSetName = 'ByPid', Mandatory = $true)]
    [Alias('Pid')]
    [ValidateRange(1, 2147483647)]
    [int]$ProcessId,

    [Parameter(ParameterSetName = 'ByName')]
    [ValidateNotNullOrEmpty()]
    [string]$ProcessName = 'python',

    [Parameter(ParameterSetName = 'All', Mandatory = $true)]
    [switch]$All,

    [ValidateRange(0, 86400)]
    [int]$IntervalSeconds = 30,

    [ValidateRange(0, 2147483647)]
    [int]$Count = 0,

    [string]$OutFile = ''
)

Set-StrictMode -Version 2.0
$ErrorActionPreference = 'Stop'

$WmiClass = 'Win32_PerfFormattedData_GPUPerformanceCounters_GPUProcessMemory'
$CsvHeader = 'timestamp,pid,process,dedicated,shared,local,non_local'
$Invariant = [System.Globalization.CultureInfo]::InvariantCulture
# Index of each memory kind in the per-pid arrays, keyed by the English counter name (lower case,
# as Get-Counter reports it).
$CounterIndex = @{
    'dedicated usage' = 0
    'shared usage'    = 1
    'local usage'     = 2
    'non local usage' = 3
}
$CounterPaths = @(
    '\GPU Process Memory(*)\Dedicated Usage',
    '\GPU Process Memory(*)\Shared Usage',
    '\GPU Process Memory(*)\Local Usage',
    '\GPU Process Memory(*)\Non Local Usage'
)

function Write-Note {
    param([string]$Message)
    Write-Host ('gpu_mem_sampler: ' + $Message)
}

function ConvertTo-CsvField {
    param([string]$Text)
    if ($Text.IndexOfAny([char[]]@(',', '"', "`r", "`n")) -ge 0) {
        return '"' + $Text.Replace('"', '""') + '"'
    }
    return $Text
}

function Add-Usage {
    # Adds one instance's bytes to the pid's running sums (instances: one per adapter LUID / phys).
    param([hashtable]$Table, [int]$Id, [int]$Index, $Value)
    if (-not $Table.ContainsKey($Id)) {
        $Table[$Id] = [uint64[]]@(0, 0, 0, 0)
    }
    if ($null -ne $Value) {
        $Table[$Id][$Index] = [uint64]($Table[$Id][$Index] + [uint64][math]::Round([double]$Value))
    }
}

function Get-GpuMemoryByPid {
    # Returns a hashtable: pid -> uint64[4] (dedicated, shared, local, non-local bytes).
    param([string]$Source)
    $table = @{}
    if ($Source -eq 'wmi') {
        $rows = @(Get-CimInstance -ClassName $WmiClass -ErrorAction Stop)
        foreach ($row in $rows) {
            if ($row.Name -match '^pid_(\d+)_') {
                $id = [int]$Matches[1]
                Add-Usage -Table $table -Id $id -Index 0 -Value $row.DedicatedUsage
                Add-Usage -Table $table -Id $id -Index 1 -Value $row.SharedUsage
                Add-Usage -Table $table -Id $id -Index 2 -Value $row.LocalUsage
                Add-Usage -Table $table -Id $id -Index 3 -Value $row.NonLocalUsage
            }
        }
        return $table
    }
    # Get-Counter reports an instance that vanished between listing and reading as a non-terminating
    # error; keep the other samples and fail only when nothing came back.
    $counterErrors = $null
    $set = Get-Counter -Counter $CounterPaths -ErrorAction SilentlyContinue -ErrorVariable counterErrors
    if ($null -eq $set) {
        $why = 'no data'
        if ($counterErrors) {
            $why = [string]$counterErrors[0]
        }
        throw ("Get-Counter '\GPU Process Memory(*)' failed: " + $why)
    }
    foreach ($sample in $set.CounterSamples) {
        if ($sample.InstanceName -match '^pid_(\d+)_') {
            $id = [int]$Matches[1]
            $leaf = ($sample.Path -split '\\')[-1].ToLowerInvariant()
            if ($CounterIndex.ContainsKey($leaf)) {
                Add-Usage -Table $table -Id $id -Index $CounterIndex[$leaf] -Value $sample.CookedValue
            }
        }
    }
    return $table
}

function Get-ProcessNames {
    # pid -> process name (without .exe), for every live process.
    $names = @{}
    foreach ($p in @(Get-Process -ErrorAction SilentlyContinue)) {
        $names[[int]$p.Id] = $p.ProcessName
    }
    return $names
}

function Test-NameMatch {
    param([string]$Name, [string]$Pattern)
    if ($Name -like $Pattern) {
        return $true
    }
    # 'python' also matches python3 and python3.11.
    return ($Name -like ($Pattern + '[0-9]*'))
}

function Select-Source {
    # The WMI class is language-neutral; the English counter names are the fallback.
    try {
        $null = @(Get-CimInstance -ClassName $WmiClass -ErrorAction Stop)
        return 'wmi'
    }
    catch {
        $wmiError = $_.Exception.Message
    }
    try {
        $null = Get-Counter -ListSet 'GPU Process Memory' -ErrorAction Stop
        return 'counter'
    }
    catch {
        throw ("no GPU memory counters: WMI class $WmiClass failed ($wmiError) and counter set " +
            "'GPU Process Memory' is missing; needs Windows 10 1709+ with a WDDM 2.x GPU driver")
    }
}

if ($PSCmdlet.ParameterSetName -eq 'ByName' -and $ProcessName -like '*.exe') {
    $ProcessName = $ProcessName.Substring(0, $ProcessName.Length - 4)
}

$outPath = ''
if ($OutFile -ne '') {
    $outPath = $ExecutionContext.SessionState.Path.GetUnresolvedProviderPathFromPSPath($OutFile)
}
# UTF-8 without a byte-order mark, so that CSV readers see 'timestamp' as the first column name.
$utf8 = New-Object System.Text.UTF8Encoding -ArgumentList $false

$samples = 0
$rowsWritten = 0
$stopReason = 'stopped by Ctrl-C'
$exitCode = 0
$started = $false

try {
    if ($PSCmdlet.ParameterSetName -eq 'ByPid') {
        if ($null -eq (Get-Process -Id $ProcessId -ErrorAction SilentlyContinue)) {
            throw ("no process with id $ProcessId")
        }
        $what = "process $ProcessId"
    }
    elseif ($PSCmdlet.ParameterSetName -eq 'All') {
        $what = 'every process using the GPU'
    }
    else {
        $what = "processes named '$ProcessName'"
    }

    $source = Select-Source
    if ($source -eq 'wmi') {
        Write-Note ("source: WMI $WmiClass")
    }
    else {
        Write-Note "source: Get-Counter '\GPU Process Memory(*)' (WMI class unavailable)"
    }
    $target = 'console'
    if ($outPath -ne '') {
        $target = $outPath
        $isNew = $true
        if (Test-Path -LiteralPath $outPath -PathType Leaf) {
            $isNew = ((Get-Item -LiteralPath $outPath).Length -eq 0)
        }
        if ($isNew) {
            [System.IO.File]::AppendAllText($outPath, $CsvHeader + "`r`n", $utf8)
        }
    }
    Write-Note ("sampling $what every $IntervalSeconds s into $target; Ctrl-C stops")
    $started = $true
    Write-Output $CsvHeader

    while ($true) {
        if ($PSCmdlet.ParameterSetName -eq 'ByPid') {
            if ($null -eq (Get-Process -Id $ProcessId -ErrorAction SilentlyContinue)) {
                $stopReason = "process $ProcessId exited"
                break
            }
        }
        $stamp = (Get-Date).ToString("yyyy-MM-dd'T'HH:mm:sszzz", $Invariant)
        try {
            $usage = Get-GpuMemoryByPid -Source $source
        }
        catch {
            if ($samples -eq 0) {
                throw
            }
            # A later failure is often transient (a driver reset): say so and keep sampling.
            Write-Warning ("gpu_mem_sampler: sample failed, skipped: " + $_.Exception.Message)
            $usage = $null
        }
        if ($null -ne $usage) {
            $names = Get-ProcessNames
            $lines = New-Object System.Collections.Generic.List[string]
            foreach ($id in @($usage.Keys | Sort-Object)) {
                $name = ''
                if ($names.ContainsKey($id)) {
                    $name = $names[$id]
                }
                if ($PSCmdlet.ParameterSetName -eq 'ByPid') {
                    if ($id -ne $ProcessId) {
                        continue
                    }
                }
                elseif ($PSCmdlet.ParameterSetName -eq 'ByName') {
                    if (-not (Test-NameMatch -Name $name -Pattern $ProcessName)) {
                        continue
                    }
                }
                $u = $usage[$id]
                $fields = @(
                    $stamp,
                    $id.ToString($Invariant),
                    (ConvertTo-CsvField -Text $name),
                    $u[0].ToString($Invariant),
                    $u[1].ToString($Invariant),
                    $u[2].ToString($Invariant),
                    $u[3].ToString($Invariant)
                )
                $lines.Add($fields -join ',')
            }
            if ($lines.Count -gt 0) {
                if ($outPath -ne '') {
                    [System.IO.File]::AppendAllText($outPath, (($lines -join "`r`n") + "`r`n"), $utf8)
                }
                foreach ($line in $lines) {
                    Write-Output $line
                }
                $rowsWritten += $lines.Count
            }
        }
        $samples += 1
        if ($Count -gt 0 -and $samples -ge $Count) {
            $stopReason = "took $Count sample(s)"
            break
        }
        Start-Sleep -Seconds $IntervalSeconds
    }
}
catch {
    $host.UI.WriteErrorLine('gpu_mem_sampler: ' + $_.Exception.Message)
    $stopReason = ''
    $exitCode = 2
}
finally {
    # Runs on Ctrl-C too (the catch block does not).
    if ($started -and $stopReason -ne '') {
        Write-Note ("$stopReason; $samples sample(s), $rowsWritten row(s)")
    }
}
exit $exitCode
